#!/bin/sh
# A chanwatch --exec worker in shell (curl): ready at once, then commits a heartbeat position every second until released (SIGTERM) or fenced (409).
post() { curl -s -o /dev/null -w '%{http_code}' -X POST -H "Authorization: Bearer $CHANWATCH_AGENT_TOKEN" -H 'Content-Type: application/json' -d "$2" "$CHANWATCH_AGENT_URL/$1"; }
trap 'echo "released"; exit 0' TERM
echo "channel $CHANWATCH_CHANNEL epoch $CHANWATCH_EPOCH on node $CHANWATCH_NODE, resuming after '$CHANWATCH_RESUME_POSITION'"
post ready '{}' >/dev/null
n=${CHANWATCH_RESUME_POSITION:-0}
while :; do
  code=$(post commit "{\"position\":\"$((n + 1))\"}")
  case $code in 200) n=$((n + 1)) ;; 409) echo "fenced: exiting"; exit 0 ;; esac
  { sleep 1 & wait $!; } 2>/dev/null # no "Terminated" line for the sleep on release
done
