"""Executors that start their own worker processes (distributed_executor_backend="mp")."""
