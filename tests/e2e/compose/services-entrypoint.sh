#!/bin/sh
# With a command: run it (the redis service). Without: PostgreSQL as the official image runs it.
set -eu
if [ "$#" -gt 0 ]; then
  exec "$@"
fi
bin=$(ls -d /usr/lib/postgresql/*/bin | head -n 1)
data=/var/lib/postgresql/data
mkdir -p "$data" /run/postgresql
chown postgres:postgres "$data" /run/postgresql
chmod 700 "$data"
if [ ! -s "$data/PG_VERSION" ]; then
  printf '%s\n' "$POSTGRES_PASSWORD" > /run/postgresql/password
  chown postgres /run/postgresql/password
  runuser -u postgres -- "$bin/initdb" -D "$data" -U "$POSTGRES_USER" --pwfile=/run/postgresql/password \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm /run/postgresql/password
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$data/pg_hba.conf"
  runuser -u postgres -- "$bin/pg_ctl" -D "$data" -o "-c listen_addresses=''" -w start >/dev/null
  runuser -u postgres -- "$bin/createdb" -U "$POSTGRES_USER" "$POSTGRES_DB"
  runuser -u postgres -- "$bin/pg_ctl" -D "$data" -m fast -w stop >/dev/null
fi
exec runuser -u postgres -- "$bin/postgres" -D "$data" -c listen_addresses='*'
