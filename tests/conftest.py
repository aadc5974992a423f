import os
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; the variable is read when @triton.jit
# runs, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's FX graph cache does not notice a changed fake implementation: start every run fresh.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="oscar-inductor-"))
torch.set_num_threads(max(1, min(torch.get_num_threads(), int(os.environ.get("OMP_NUM_THREADS", "1")))))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
