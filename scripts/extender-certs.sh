#!/usr/bin/env bash
# The certificates of the mutual TLS between the second kube-scheduler and the gpuslice extender,
# and the admission webhook's serving certificate, with openssl alone (the alternative to
# deploy/cert-manager; the Helm chart issues its own):
#
#   ca.crt ca.key            a CA made for these two certificates alone (EC P-256), so that the
#                            extender's --client-ca trusts nothing else
#   extender.crt .key        the extender's serving certificate (serverAuth) for
#                            gpuslice-extender.NAMESPACE.svc and its shorter names
#   scheduler.crt .key       the second scheduler's client certificate (clientAuth,
#                            CN=gpuslice-scheduler): its tlsConfig certFile/keyFile
#   webhook.crt .key         the admission webhook's serving certificate (serverAuth) for
#                            gpuslice-webhook.NAMESPACE.svc; the API server checks it with
#                            ca.crt, the MutatingWebhookConfiguration's caBundle
#
# Usage: scripts/extender-certs.sh [--namespace NS] [--days N] [--out DIR] [--apply]
#   --namespace NS  where gpuslice runs (default gpuslice-system): the serving certificate's names
#   --days N        validity of the two certificates (default 825); the CA's is 10 years
#   --out DIR       where the files go (default ./gpuslice-extender-certs, mode 0700). A DIR that
#                   already holds ca.crt and ca.key keeps that CA: run again to renew the two
#                   certificates (the extender and kube-scheduler read renewed files without a
#                   restart; a new CA needs both restarted)
#   --apply         also create or replace the Secrets gpuslice-extender-tls (extender.crt/.key as
#                   tls.crt/tls.key, ca.crt), gpuslice-scheduler-tls (scheduler.crt/.key,
#                   ca.crt) and gpuslice-webhook-tls (webhook.crt/.key, ca.crt) in NS with
#                   kubectl ($KUBECTL, default kubectl), and write ca.crt into the caBundle of
#                   the MutatingWebhookConfiguration gpuslice-webhook when it exists (after
#                   kubectl apply -k deploy/...; run again with the same --out otherwise)
# Keep ca.key out of the cluster and safe (whoever holds it can mint a scheduler certificate),
# or delete it and run again with a new DIR when the certificates are due.
# Needs openssl 1.1.1 or newer. Exit status: 0 done, 1 a command failed, 2 bad arguments.
set -euo pipefail

ns=gpuslice-system
days=825
out=./gpuslice-extender-certs
apply=0
while [ $# -gt 0 ]; do
    case "$1" in
        --namespace) ns=${2:?--namespace needs a value}; shift 2 ;;
        --days) days=${2:?--days needs a value}; shift 2 ;;
        --out) out=${2:?--out needs a value}; shift 2 ;;
        --apply) apply=1; shift ;;
        -h|--help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "extender-certs.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$days" in ''|*[!0-9]*|0) echo "extender-certs.sh: --days: expected a positive number of days, got $days" >&2; exit 2 ;; esac
command -v openssl >/dev/null || { echo "extender-certs.sh: openssl is not installed" >&2; exit 2; }

umask 077
mkdir -p "$out"
cd "$out"
if [ ! -s ca.crt ] || [ ! -s ca.key ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
        -subj "/CN=gpuslice-extender-ca" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -keyout ca.key -out ca.crt 2>/dev/null
    echo "new CA: $out/ca.crt"
fi

# issue NAME SUBJECT EXTENDED-KEY-USAGE [SUBJECT-ALT-NAMES]
issue() {
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$3"
        echo "subjectKeyIdentifier=hash"
        echo "authorityKeyIdentifier=keyid"
        if [ -n "${4:-}" ]; then echo "subjectAltName=$4"; fi
    } > "$1.ext"
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "$2" \
        -keyout "$1.key" -out "$1.csr" 2>/dev/null
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
        -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
    openssl verify -CAfile ca.crt "$1.crt" >/dev/null
}

svc="gpuslice-extender.$ns.svc"
issue extender "/CN=$svc" serverAuth \
    "DNS:gpuslice-extender,DNS:gpuslice-extender.$ns,DNS:$svc,DNS:$svc.cluster.local"
issue scheduler "/CN=gpuslice-scheduler" clientAuth
hook="gpuslice-webhook.$ns.svc"
issue webhook "/CN=$hook" serverAuth \
    "DNS:gpuslice-webhook,DNS:gpuslice-webhook.$ns,DNS:$hook,DNS:$hook.cluster.local"
echo "extender (serving $svc), scheduler (client) and webhook (serving $hook) certificates" \
    "in $out, valid $days days"

if [ "$apply" = 1 ]; then
    kubectl=${KUBECTL:-kubectl}
    secret() {  # NAME CERT KEY
        "$kubectl" -n "$ns" create secret generic "$1" --type=kubernetes.io/tls \
            --from-file=tls.crt="$2" --from-file=tls.key="$3" --from-file=ca.crt=ca.crt \
            --dry-run=client -o yaml | "$kubectl" apply -f -
    }
    secret gpuslice-extender-tls extender.crt extender.key
    secret gpuslice-scheduler-tls scheduler.crt scheduler.key
    secret gpuslice-webhook-tls webhook.crt webhook.key
    bundle=$(base64 < ca.crt | tr -d '\n')
    patch="[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$bundle\"},"
    patch="$patch{\"op\":\"add\",\"path\":\"/webhooks/1/clientConfig/caBundle\",\"value\":\"$bundle\"}]"
    if "$kubectl" get mutatingwebhookconfiguration gpuslice-webhook >/dev/null 2>&1; then
        "$kubectl" patch mutatingwebhookconfiguration gpuslice-webhook --type=json -p "$patch"
    else
        echo "no MutatingWebhookConfiguration gpuslice-webhook yet: after kubectl apply -k," \
            "run this script again with --out $out --apply (it keeps the CA)"
    fi
fi
