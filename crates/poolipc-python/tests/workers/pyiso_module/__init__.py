"""The module pyisolate loads from the extension's module_path (nothing to set up)."""
