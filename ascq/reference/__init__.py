"""Plain-PyTorch reference models (calibration and the reference backend), Hugging Face tensor names."""
