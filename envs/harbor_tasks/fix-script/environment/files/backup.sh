#!/bin/bash
# Copy every .txt file of /app/data into /app/backup and say how many were copied.
source_dir=/app/data
target_dir=/app/backup
count=0
for file in "$sourcedir"/*.txt; do
  cp "$file" "$target_dir/"
  count=$((count + 1))
done
echo "copied $count files"
