"""Prometheus alert rules and the Grafana dashboard shipped with compass (read by compass.infra.prometheus)."""
