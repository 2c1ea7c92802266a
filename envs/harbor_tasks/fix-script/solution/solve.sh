#!/bin/bash
# Two bugs: the loop reads $sourcedir (unset) instead of $source_dir, and the target directory is
# never created.
cat > /app/backup.sh <<'SCRIPT'
#!/bin/bash
# Copy every .txt file of /app/data into /app/backup and say how many were copied.
source_dir=/app/data
target_dir=/app/backup
mkdir -p "$target_dir"
count=0
for file in "$source_dir"/*.txt; do
  cp "$file" "$target_dir/"
  count=$((count + 1))
done
echo "copied $count files"
SCRIPT
