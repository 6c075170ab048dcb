"""Multi-process execution: the executor that starts and drives ranks, and pipeline-parallel stages."""
