"""Prefect flows: one per stage and the full pipeline. They only wire the DAG."""
