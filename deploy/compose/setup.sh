#!/bin/sh
# The simulated fleet's one-off setup, run by the `setup` service before anything else starts: the tables, the
# catalog, an API key, and each agent's node with its token in the shared `tokens` volume. Safe to run again.
set -eu
until llmgw migrate --noinput; do
  echo "waiting for the database"; sleep 2
done
llmgw catalog apply /fleet/catalog.yaml
llmgw keys list | grep -q "	compose$" || llmgw keys create compose --key "$LLMGW_COMPOSE_API_KEY" >/dev/null
for node in agent-1 agent-2 agent-3; do
  [ -s "/tokens/$node" ] || llmgw enrol "$node" --address "$node" --fabric compose > "/tokens/$node"
done
echo "fleet ready: 3 nodes enrolled"
