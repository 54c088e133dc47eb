"""Schemathesis (v4, `pip install schemathesis`) against a running `dllm serve`'s published /openapi.json: N
schema-valid requests per operation, each answer checked against the schema (status, media type, body); prints
the requests sent, the share answered 2xx, the server errors (5xx), the answers the schema does not describe, and
the refusals (4xx) and failures (5xx) by message, most frequent first.

    dllm serve --port 8000 &
    python scripts/schema_fuzz.py http://127.0.0.1:8000 --examples 100
"""
from __future__ import annotations

import argparse
import collections
import json


def fuzz(url: str, examples: int = 100, seed: int = 0) -> dict:
    """Send `examples` schema-valid requests (positive mode) to each operation of the server at `url`."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    statuses: collections.Counter = collections.Counter()
    refusals: collections.Counter = collections.Counter()
    mismatches: list[str] = []
    failures: list[str] = []  # the bodies that got a 5xx
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(operation.as_strategy())
        @settings(max_examples=examples, database=None, derandomize=True, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def send(case):
            response = case.call(base_url=url, timeout=120)
            statuses[response.status_code // 100 * 100] += 1
            if response.status_code >= 400:
                refusals[f"{response.status_code} {response.json()['error']['message'][:100]}"] += 1
            if response.status_code >= 500:
                failures.append(f"{operation.label} {json.dumps(case.body)[:400]}")
            try:
                case.validate_response(response, checks=[schemathesis.checks.response_schema_conformance,
                                                         schemathesis.checks.status_code_conformance,
                                                         schemathesis.checks.content_type_conformance])
            except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001  (the answer is not what the schema says)
                found = getattr(e, "exceptions", [e])
                mismatches.append(f"{operation.label} {response.status_code}: " + "; ".join(
                    f"{getattr(f, 'title', type(f).__name__)}: {str(getattr(f, 'message', f))[:200]}" for f in found))

        send()
    sent = sum(statuses.values())
    return {"requests": sent, "ok_share": statuses[200] / sent, "server_errors": statuses[500], "statuses":
            dict(statuses), "mismatches": mismatches, "failures": failures, "refusals": refusals.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--examples", type=int, default=100, help="requests per operation")
    args = ap.parse_args()
    result = fuzz(args.url, args.examples)
    print(f"requests {result['requests']}, answered 2xx {result['ok_share']:.1%}, server errors "
          f"{result['server_errors']}, answers the schema does not describe {len(result['mismatches'])}")
    for line in result["mismatches"][:20]:
        print("  mismatch:", line)
    for line in result["failures"]:
        print("  server error:", line)
    for message, count in result["refusals"]:
        print(f"  {count:4} x {message}")
    print(json.dumps({k: v for k, v in result.items() if k not in ("refusals", "mismatches", "failures")}))


if __name__ == "__main__":
    main()
