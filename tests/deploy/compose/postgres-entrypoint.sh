#!/bin/sh
# First start: a cluster whose superuser is POSTGRES_USER (password from POSTGRES_PASSWORD_FILE,
# checked on TCP), and the database POSTGRES_DB; then the server on every address.
set -eu
data=/var/lib/postgresql/data
if [ ! -s "$data/PG_VERSION" ]; then
    initdb --pgdata="$data" --username="$POSTGRES_USER" --pwfile="$POSTGRES_PASSWORD_FILE" \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    echo "host all all all scram-sha-256" >>"$data/pg_hba.conf"
    pg_ctl --pgdata="$data" --wait --options="-c listen_addresses='' -c unix_socket_directories=/tmp" start >/dev/null
    createdb --host=/tmp --username="$POSTGRES_USER" "$POSTGRES_DB"
    pg_ctl --pgdata="$data" --wait --mode=fast stop >/dev/null
fi
exec postgres -D "$data" -c listen_addresses='*' -c unix_socket_directories=/tmp
