"""The SLA planner as a tool: read profiles and services, plan, check by replay, export."""
