"""FX graph analysis and rewrite for the oscar torch.compile backend."""
