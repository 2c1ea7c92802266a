#!/bin/bash
tr 'A-Z' 'a-z' < /app/notes.txt | tr -c 'a-z\n' ' ' | tr -s ' ' '\n' | grep -v '^$' \
  | sort | uniq -c | sort -k1,1nr -k2,2 | head -3 | awk '{print $2, $1}' > /app/top.txt
