#!/usr/bin/env bash
# Credentials, the NATS auth config and TLS certificates for the secured deployments (docs/deploy.md).
#
#   deploy/make-secrets.sh compose             files for docker-compose.yml, in deploy/secrets/
#   deploy/make-secrets.sh k8s NODE [NODE...]  the same, plus Kubernetes Secret manifests in deploy/secrets/k8s/
#                                              (one agent credential per GPU node name); apply them with
#                                              kubectl apply -f deploy/secrets/k8s/   (or set APPLY=1)
#
# Keys and credentials come from `timeslice auth` (the operator and account keys stay in $AUTH_DIR, default
# deploy/secrets/auth: keep that directory safe, it can issue every credential); the TLS certificates from a
# private CA made here with openssl. Running it again keeps the keys, the CA and every file that exists, and
# makes only what is missing (a new node: run k8s again with the new node name). Files are 0600; nothing secret
# is ever passed on a command line.
#
# Environment: TIMESLICE (the CLI, default `timeslice`), OUT (default deploy/secrets), AUTH_DIR, NAMESPACE
# (default timeslice), DAYS (certificate lifetime, default 825), APPLY=1 (kubectl apply the Secrets).
set -euo pipefail
umask 077

here=$(cd "$(dirname "$0")" && pwd)
TIMESLICE=${TIMESLICE:-timeslice}
OUT=${OUT:-$here/secrets}
AUTH_DIR=${AUTH_DIR:-$OUT/auth}
NAMESPACE=${NAMESPACE:-timeslice}
DAYS=${DAYS:-825}

usage() { sed -n '2,8p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
mode=$1; shift
case "$mode" in
  compose) nodes=(node-0) ;;
  k8s) [ $# -ge 1 ] || { echo "make-secrets.sh k8s: name the GPU nodes (kubectl get nodes)" >&2; exit 2; }
       nodes=("$@") ;;
  *) usage ;;
esac
for n in "${nodes[@]}"; do
  [[ "$n" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$ ]] || { echo "make-secrets.sh: $n is not a timeslice node id (letters, digits, _ and -, at most 64)" >&2; exit 2; }
done
mkdir -p "$OUT"

# ---------------------------------------------------------------------------------------- TLS

ca() {
  [ -f "$OUT/ca.key" ] && return
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$DAYS" \
    -keyout "$OUT/ca.key" -out "$OUT/ca.crt" -subj "/CN=timeslice CA" 2>/dev/null
}

# cert NAME SAN[,SAN...]: a certificate for servers (and, for the NATS routes, their clients) signed by the CA.
cert() {
  local name=$1 san=$2
  [ -f "$OUT/$name.crt" ] && return
  local ext
  ext=$(mktemp)
  printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=%s\n' \
    "$san" > "$ext"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$OUT/$name.key" \
    -out "$OUT/$name.csr" -subj "/CN=$name" 2>/dev/null
  openssl x509 -req -in "$OUT/$name.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" -CAcreateserial -days "$DAYS" \
    -extfile "$ext" -out "$OUT/$name.crt" 2>/dev/null
  rm -f "$ext" "$OUT/$name.csr"
}

ca
svc="$NAMESPACE.svc"
cert nats "DNS:*.nats-headless.$svc,DNS:nats.$svc,DNS:nats.$svc.cluster.local,DNS:nats-1,DNS:nats-2,DNS:nats-3,DNS:localhost,IP:127.0.0.1"
cert grpc "DNS:orchestrator.$svc,DNS:orchestrator.$svc.cluster.local,DNS:orchestrator,DNS:orchestrator-1,DNS:orchestrator-2,DNS:localhost,IP:127.0.0.1"

# ---------------------------------------------------------------------------------------- credentials

"$TIMESLICE" auth init --dir "$AUTH_DIR" >/dev/null
issue() {  # issue FILE ROLE [ARGS...]
  local file=$1; shift
  [ -f "$OUT/$file" ] || "$TIMESLICE" auth "$@" --dir "$AUTH_DIR" --out "$OUT/$file" >/dev/null
}
issue orchestrator.creds orchestrator
for n in "${nodes[@]}"; do issue "agent-$n.creds" agent --node "$n"; done
issue admin.creds admin
"$TIMESLICE" auth server-config --dir "$AUTH_DIR" --out "$OUT/nats-auth.conf" >/dev/null  # always: revocations
chmod 600 "$OUT"/*.key "$OUT"/*.creds "$OUT/nats-auth.conf"
chmod 644 "$OUT/ca.crt" "$OUT"/nats.crt "$OUT"/grpc.crt

if [ "$mode" = compose ]; then
  echo "make-secrets.sh: deploy/secrets/ is ready for docker compose (admin credential: $OUT/admin.creds)"
  exit 0
fi

# ---------------------------------------------------------------------------------------- Kubernetes Secrets

mkdir -p "$OUT/k8s"
secret() {  # secret NAME --from-file=KEY=PATH ...
  local name=$1; shift
  kubectl create secret generic "$name" --namespace "$NAMESPACE" "$@" --dry-run=client -o yaml > "$OUT/k8s/$name.yaml"
}
secret nats-auth --from-file=nats-auth.conf="$OUT/nats-auth.conf"
secret nats-tls --from-file=tls.crt="$OUT/nats.crt" --from-file=tls.key="$OUT/nats.key" --from-file=ca.crt="$OUT/ca.crt"
secret timeslice-ca --from-file=ca.crt="$OUT/ca.crt"
secret orchestrator-creds --from-file=orchestrator.creds="$OUT/orchestrator.creds"
secret orchestrator-grpc-tls --from-file=tls.crt="$OUT/grpc.crt" --from-file=tls.key="$OUT/grpc.key"
agent_files=()
for f in "$OUT"/agent-*.creds; do
  n=$(basename "$f" .creds); n=${n#agent-}
  agent_files+=("--from-file=$n.creds=$f")
done
secret agent-creds "${agent_files[@]}"
if [ "${APPLY:-0}" = 1 ]; then
  kubectl apply -f "$OUT/k8s/"
fi
echo "make-secrets.sh: Secrets for namespace $NAMESPACE in $OUT/k8s/ (agents: ${nodes[*]})"
