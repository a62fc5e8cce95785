"""The command-line tools: `fastreduce-bench` and `fastreduce-info`."""
