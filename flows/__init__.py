"""Compiler (spec -> Plan), the Prefect flows that execute a Plan, and the `compass` CLI."""
