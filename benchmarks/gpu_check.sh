#!/usr/bin/env bash
# The name the developers' guide uses for the prepared GPU check; the script lives in benchmarks/gpu/.
exec bash "$(dirname "$0")/gpu/check.sh" "$@"
