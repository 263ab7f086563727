"""The closing lines of a test run made of several pytest streams: the slowest tests of all of
them, then one line 'tests: N passed, N failed, N skipped' (the streams' JUnit reports, summed).

Usage: python tests/helpers/junit_summary.py SLOWEST REPORT.xml [REPORT.xml ...]
Exit status: 0 when every stream's report exists and nothing failed, 1 otherwise.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(argv: list[str]) -> int:
    slowest, reports = int(argv[0]), argv[1:]
    passed = failed = skipped = 0
    times: list[tuple[float, str]] = []
    ok = True
    for path in reports:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            print(f"tests: the report {path} is missing or unreadable ({e})")
            ok = False
            continue
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            times.append((float(case.get("time") or 0.0), name))
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
    if slowest:
        print(f"\nslowest {slowest} tests of all streams:")
        for seconds, name in sorted(times, reverse=True)[:slowest]:
            print(f"  {seconds:7.2f}s  {name}")
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 0 if ok and failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
