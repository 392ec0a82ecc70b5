#!/bin/sh
# A box's own PostgreSQL (store.server: true), the Files and Batch APIs' store that every gateway worker shares, from
# Debian's postgresql package: in compose its container (store-image/), under systemd its unit. Made at its first start
# in $PGDATA (the superuser rtxserve, its password the first line of $STORE_PASSWORD_FILE, the database rtxserve), then
# served on $STORE_LISTEN:$STORE_PORT with password authentication (scram-sha-256) and no Unix socket.
# `start-store.sh wait`: until it accepts connections (a unit's ExecStartPost=), at most 120 s.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
if [ "${1:-}" = wait ]; then
    for _ in $(seq 240); do
        "$bin/pg_isready" -q -h "${STORE_LISTEN:-127.0.0.1}" -p "${STORE_PORT:-5432}" && exit 0
        sleep 0.5
    done
    echo "the store did not accept connections within 120 s" >&2
    exit 1
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    "$bin/initdb" --pgdata="$PGDATA" --username=rtxserve --pwfile="$STORE_PASSWORD_FILE" --auth=scram-sha-256 \
        --encoding=UTF8 --no-locale >/dev/null
    echo "CREATE DATABASE rtxserve" | "$bin/postgres" --single -D "$PGDATA" postgres >/dev/null
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
fi
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses="${STORE_LISTEN:-*}" -c port="${STORE_PORT:-5432}" \
    -c unix_socket_directories=
