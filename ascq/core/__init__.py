"""The bottom layer: facts every other package reads and that import nothing else of ascq — errors,
quantization math, architecture descriptions, rotary and RMSNorm math."""
