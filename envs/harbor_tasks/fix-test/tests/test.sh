#!/bin/bash
# 1 when the original tests (a fresh copy from /tests, not the agent's) pass against /app/intervals.py.
cp /tests/reference_tests.py /tmp/test_intervals.py
cp /app/intervals.py /tmp/intervals.py
if (cd /tmp && python3 -m unittest test_intervals > /logs/verifier/unittest.txt 2>&1); then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
