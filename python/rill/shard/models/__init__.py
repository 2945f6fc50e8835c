"""Model architectures: one pure-torch file per family, looked up by HF `model_type` in registry.py."""
