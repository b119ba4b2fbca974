"""The top layer. Here: the compiler (spec -> Plan), validation before a run, the runner of one step, the Prefect
lifecycle and scheduled-evaluation flows, and what a running step shows live. cli/ is the `compass` command line,
reports/ what it prints, server/ compass on a Prefect server (deployments, submissions, the worker)."""
