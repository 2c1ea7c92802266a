#!/bin/bash
# 1 when backup.sh, run on a fresh data directory, copies exactly the .txt files and says so, else 0.
reward=0
rm -rf /app/backup /tmp/check && mkdir -p /tmp/check && cp -r /app/data /tmp/check/saved
printf 'gamma\n' > /app/data/g.txt
output="$(bash /app/backup.sh 2>&1)"
if [ "$output" = "copied 3 files" ] \
   && [ "$(ls /app/backup | tr '\n' ' ')" = "a.txt b.txt g.txt " ] \
   && [ "$(cat /app/backup/g.txt)" = "gamma" ]; then
  reward=1
fi
rm -f /app/data/g.txt
echo $reward > /logs/verifier/reward.txt
