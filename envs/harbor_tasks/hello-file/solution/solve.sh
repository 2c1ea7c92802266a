#!/bin/bash
echo 'Hello, rollwise!' > /app/greeting.txt
