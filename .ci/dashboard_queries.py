#!/usr/bin/env python3
"""Write every PromQL query of docs/grafana-dashboard.json as a recording
rule, so `promtool check rules` parses each one (Grafana variables replaced
by values a real query would get)."""
import json
import sys

dashboard = json.load(open(sys.argv[1]))
rules = []
for panel in dashboard["panels"]:
    for target in panel.get("targets", []):
        expr = (
            target["expr"]
            .replace("$__rate_interval", "5m")
            .replace("$route", ".*")
            .replace("$provider", ".*")
            .replace("$target", ".*")
        )
        rules.append({"record": f"iop:dashboard:{panel['id']}_{target['refId']}", "expr": expr})
print(json.dumps({"groups": [{"name": "dashboard-queries", "rules": rules}]}, indent=1))
