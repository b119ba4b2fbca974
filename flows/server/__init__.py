"""compass on a Prefect server: deployments, submitting a spec as a flow run, the process worker, the server's
database, and what a shared worker may read on a submitter's behalf."""
