"""report.py must fail a run with a copy under another x-delayd-id or a
lost twin copy, and must say so loudly.

    python3 scripts/faults/report_test.py
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

REPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.py")


def bench(other_id=0):
    return {
        "published": 1000, "publish_failures": 0, "received": 1000 + other_id,
        "lost": 0, "early": 0, "duplicates": other_id,
        "duplicates_same_id": 0, "duplicates_different_id": other_id,
        "redelivered_to_bench": 0, "lateness_p99_ms": 10, "lateness_max_ms": 20,
        "different_id_examples": [[7, "a" * 32, "b" * 32]] if other_id else [],
    }


def run(report, *args):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(report, f)
    try:
        return subprocess.run([sys.executable, REPORT, "s", "1", "60", "20", f.name, *args],
                              capture_output=True, text=True)
    finally:
        os.unlink(f.name)


class Verdict(unittest.TestCase):
    def test_a_clean_run_passes(self):
        self.assertEqual(run(bench()).returncode, 0)

    def test_a_copy_under_another_id_fails(self):
        out = run(bench(other_id=1))
        self.assertEqual(out.returncode, 1, out.stdout)
        self.assertIn("FAIL: 1 copies under another x-delayd-id", out.stdout)

    def test_a_lost_twin_copy_fails(self):
        report = dict(bench(), twins=100, twin_copies_lost=2)
        out = run(report)
        self.assertEqual(out.returncode, 1, out.stdout)
        self.assertIn("twins 100, copies lost 2", out.stdout)
        self.assertIn("FAIL: 2 twin copies lost", out.stdout)

    def test_twins_under_one_id_are_listed_and_pass(self):
        report = dict(bench(), twins=100, twin_copies_lost=0, twins_under_one_id=3)
        out = run(report)
        self.assertEqual(out.returncode, 0, out.stdout)
        self.assertIn("under one id 3", out.stdout)
    def owners(self, *lines):
        with tempfile.NamedTemporaryFile("w", suffix=".owners", delete=False) as f:
            f.write("".join(f"{100 + i * 0.2:.1f} {line}\n" for i, line in enumerate(lines)))
        try:
            return run(bench(), "--owners", f.name, "--replicas", "3")
        finally:
            os.unlink(f.name)

    def test_a_hand_over_between_two_reads_is_not_two_owners(self):
        out = self.owners("1 0 1 0", "1 1 0 1", "1 0 0 1", "0 1 0 1")
        self.assertEqual(out.returncode, 0, out.stdout)
        self.assertIn("two owners 0 samples", out.stdout)

    def test_an_owner_read_between_two_readings_of_the_other_is_two_owners(self):
        for line in ("1 1 1 1", "0 1 1 1", "1 1 1 0"):
            out = self.owners("1 0 1 0", line, "0 1 0 1")
            self.assertEqual(out.returncode, 1, (line, out.stdout))
            self.assertIn("two owners 1 samples", out.stdout)

    def test_an_older_sample_of_two_reads_counts_both(self):
        out = self.owners("1 0", "1 1", "0 1")
        self.assertEqual(out.returncode, 1, out.stdout)
        self.assertIn("two owners 1 samples", out.stdout)


if __name__ == "__main__":
    unittest.main()
