#!/bin/bash
# 1 when /app/greeting.txt holds exactly the line asked for, else 0.
if [ "$(cat /app/greeting.txt 2>/dev/null)" = "Hello, rollwise!" ] && [ "$(wc -l < /app/greeting.txt)" = "1" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
