"""`python -m bench`: reproducible throughput and latency figures against real processes."""
