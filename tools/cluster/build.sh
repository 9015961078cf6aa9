#!/usr/bin/env bash
# Build the real control plane for the cluster test tier from the official Go modules pinned in
# tools/cluster/go.mod: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
# and kwok. The binaries go to
#   ${GPUSLICE_CLUSTER_CACHE:-$HOME/.cache/gpuslice/cluster}/<key>/bin
# where <key> hashes go.mod, go.sum, the Go version and the build flags, so a machine builds them
# once per pin. An existing complete build is reused.
#
#   tools/cluster/build.sh              build (or reuse) and print the bin directory last
#   tools/cluster/build.sh --bin-dir    print the bin directory only (no build)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"

command -v go >/dev/null || { echo "build.sh: 'go' is not on PATH; the cluster tier needs Go >= 1.26" >&2; exit 2; }

# the Kubernetes version stamped as the release build does (k8s.io/component-base/version,
# hack/lib/version.sh): unstamped binaries report v0.0.0-master, which clients that check the
# server's version refuse (helm's kubeVersion, the chart's check). Link-time only: a stamp change
# relinks, it does not recompile.
kver="$(sed -n 's/^[[:space:]]*k8s.io\/kubernetes \(v[0-9.]*\).*/\1/p' go.mod | head -n 1)"
[[ -n "$kver" ]] || { echo "build.sh: no k8s.io/kubernetes version in go.mod" >&2; exit 2; }
kminor="${kver#v*.}"; kminor="${kminor%%.*}"
v=k8s.io/component-base/version
ldflags="-s -w -X $v.gitVersion=$kver -X $v.gitMajor=1 -X $v.gitMinor=$kminor \
-X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z"
flags=(-trimpath -buildvcs=false "-ldflags=$ldflags")
tools=(
  "etcd=go.etcd.io/etcd/server/v3"
  "kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager"
  "kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler"
  "kubectl=k8s.io/kubernetes/cmd/kubectl"
  "kwok=sigs.k8s.io/kwok/cmd/kwok"
)

key="$( { cat go.mod go.sum; go version; echo "${flags[*]}"; printf '%s\n' "${tools[@]}"; } \
        | sha256sum | cut -c1-16)"
cache="${GPUSLICE_CLUSTER_CACHE:-$HOME/.cache/gpuslice/cluster}"
dest="$cache/$key"

if [[ "${1:-}" == "--bin-dir" ]]; then
  echo "$dest/bin"
  exit 0
fi

# kwok's standalone binary has no built-in behaviour: its stages (node initialise and
# heartbeat with leases; pod ready, complete, delete) are YAML files of the same module version,
# written next to the binaries as one config file
write_kwok_stages() {
  local dir out="$1/kwok-stages.yaml"
  dir="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)" && [[ -n "$dir" ]] || {
    echo "build.sh: cannot locate the sigs.k8s.io/kwok module (go mod download)" >&2; return 1; }
  : > "$out.tmp"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    { echo "---"; cat "$dir/kustomize/stage/$f"; } >> "$out.tmp"
  done
  mv "$out.tmp" "$out"
}

if [[ -f "$dest/complete" ]]; then
  [[ -f "$dest/bin/kwok-stages.yaml" ]] || write_kwok_stages "$dest/bin"
  echo "build.sh: cluster binaries already built in $dest/bin" >&2
  echo "$dest/bin"
  exit 0
fi

mkdir -p "$cache"
work="$(mktemp -d "$cache/.build-$key.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"

start=$SECONDS
i=0
for entry in "${tools[@]}"; do
  i=$((i + 1))
  name="${entry%%=*}"
  pkg="${entry#*=}"
  t0=$SECONDS
  echo "build.sh: [$i/${#tools[@]}] building $name ($pkg) ..." >&2
  if ! go build "${flags[@]}" -o "$work/bin/$name" "$pkg"; then
    echo "build.sh: FAILED to build $name from $pkg (see the compiler output above)" >&2
    exit 1
  fi
  echo "build.sh: [$i/${#tools[@]}] $name built in $((SECONDS - t0))s" >&2
done

write_kwok_stages "$work/bin"
"$work/bin/kube-apiserver" --version >&2
# sed, not head: head exits after one line and etcd, still writing, dies of SIGPIPE, which
# pipefail turns into a failed build
"$work/bin/etcd" --version | sed -n 1p >&2
"$work/bin/kwok" --version >&2 || true

rm -rf "$dest"
mkdir -p "$dest"
mv "$work/bin" "$dest/bin"
{ go version; echo "built in $((SECONDS - start))s on $(date -u +%FT%TZ)"; } > "$dest/complete"
echo "build.sh: all cluster binaries built in $((SECONDS - start))s into $dest/bin" >&2
echo "$dest/bin"
