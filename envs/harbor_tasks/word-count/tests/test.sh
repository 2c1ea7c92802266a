#!/bin/bash
# 1 when /app/top.txt lists the three most frequent words of notes.txt with their counts, else 0.
expected=$'the 7\nriver 4\nmill 3'
if [ "$(cat /app/top.txt 2>/dev/null)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
