#!/usr/bin/env bash
# Build the node side of the real-node tier (tests/node, `gpuslice dev-cluster up --real-node`):
#   containerd, containerd-shim-runc-v2, ctr   from tools/node/go.mod's pin (containerd v2.2.9)
#   kubelet                                     from tools/cluster/go.mod's pin (the control
#                                               plane's Kubernetes version)
#   kube-proxy, coredns                         from tools/node/net/go.mod (Kubernetes pin as
#                                               above, CoreDNS v1.15.0): Services for pods
#   images/kube-scheduler.tar                   kube-scheduler (tools/cluster pin, static) as
#                                               the image the Helm chart's second scheduler runs
#   images/pause.tar, images/busybox.tar        docker-archive images (a static pause built with
#                                               gcc, busybox-static from Debian; umoci + skopeo),
#                                               imported into containerd at start: no registry
# into ${GPUSLICE_CLUSTER_CACHE:-$HOME/.cache/gpuslice/cluster}/node-<key>/ where <key> hashes
# both go.mod/go.sum pairs, the Go version and the flags, so a machine builds them once per pin.
#
#   tools/node/build.sh             build (or reuse) and print the output folder last
#   tools/node/build.sh --dir       print the output folder only (no build)
#
# Host prerequisites (Debian): runc containernetworking-plugins iptables umoci skopeo gcc
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cluster="$(cd "$here/../cluster" && pwd)"
cd "$here"

command -v go >/dev/null || { echo "node/build.sh: 'go' is not on PATH (Go >= 1.26 needed)" >&2; exit 2; }

# the Kubernetes binaries carry their release version as tools/cluster/build.sh stamps it
kver="$(sed -n 's/^[[:space:]]*k8s.io\/kubernetes \(v[0-9.]*\).*/\1/p' "$cluster/go.mod" | head -n 1)"
kminor="${kver#v*.}"; kminor="${kminor%%.*}"
v=k8s.io/component-base/version
flags=(-trimpath -buildvcs=false "-ldflags=-s -w -X $v.gitVersion=$kver -X $v.gitMajor=1 \
-X $v.gitMinor=$kminor -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z")
ctr_tools=(containerd containerd-shim-runc-v2 ctr)
pause_ref="registry.k8s.io/pause:3.10.1"
busybox_ref="localhost/busybox:test"

scheduler_ref="localhost/kube-scheduler:v1.36.3"
key="$( { cat go.mod go.sum net/go.mod net/go.sum "$cluster/go.mod" "$cluster/go.sum"; go version;
          echo "${flags[*]}"; echo "${ctr_tools[*]} kubelet kube-proxy coredns $pause_ref";
          echo "$busybox_ref $scheduler_ref v3"; } | sha256sum | cut -c1-16)"
cache="${GPUSLICE_CLUSTER_CACHE:-$HOME/.cache/gpuslice/cluster}"
dest="$cache/node-$key"

if [[ "${1:-}" == "--dir" ]]; then
  echo "$dest"
  exit 0
fi
if [[ -f "$dest/complete" ]]; then
  echo "node/build.sh: node binaries already built in $dest" >&2
  echo "$dest"
  exit 0
fi

missing=()
for t in umoci skopeo gcc; do command -v "$t" >/dev/null || missing+=("$t"); done
if (( ${#missing[@]} )); then
  echo "node/build.sh: missing ${missing[*]} (Debian: apt-get install umoci skopeo gcc)" >&2
  exit 2
fi

mkdir -p "$cache"
work="$(mktemp -d "$cache/.build-node-$key.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/images"
start=$SECONDS

i=0
for t in "${ctr_tools[@]}"; do
  i=$((i + 1)); t0=$SECONDS
  echo "node/build.sh: [$i/8] building $t (containerd v2 module) ..." >&2
  # no cgo (static binaries), no btrfs snapshotter (needs its C headers)
  CGO_ENABLED=0 go build "${flags[@]}" -tags no_btrfs -o "$work/bin/$t" \
    "github.com/containerd/containerd/v2/cmd/$t"
  echo "node/build.sh: [$i/8] $t built in $((SECONDS - t0))s" >&2
done

t0=$SECONDS
echo "node/build.sh: [4/8] building kubelet (tools/cluster pin) ..." >&2
(cd "$cluster" && go build "${flags[@]}" -o "$work/bin/kubelet" k8s.io/kubernetes/cmd/kubelet)
echo "node/build.sh: [4/8] kubelet built in $((SECONDS - t0))s" >&2

for t in kube-proxy coredns; do
  t0=$SECONDS
  [[ $t == kube-proxy ]] && i=5 || i=6
  pkg=k8s.io/kubernetes/cmd/kube-proxy
  [[ $t == coredns ]] && pkg=github.com/coredns/coredns
  echo "node/build.sh: [$i/8] building $t (tools/node/net pin) ..." >&2
  (cd net && CGO_ENABLED=0 go build "${flags[@]}" -o "$work/bin/$t" "$pkg")
  echo "node/build.sh: [$i/8] $t built in $((SECONDS - t0))s" >&2
done
t0=$SECONDS
echo "node/build.sh: [7/8] building a static kube-scheduler (tools/cluster pin) ..." >&2
mkdir -p "$work/src/kube-scheduler/rootfs/usr/local/bin"
(cd "$cluster" && CGO_ENABLED=0 go build "${flags[@]}" \
   -o "$work/src/kube-scheduler/rootfs/usr/local/bin/kube-scheduler" k8s.io/kubernetes/cmd/kube-scheduler)
echo "node/build.sh: [7/8] kube-scheduler built in $((SECONDS - t0))s" >&2

echo "node/build.sh: [8/8] pause, busybox and kube-scheduler images ..." >&2
src="$work/src"
mkdir -p "$src/pause/rootfs" "$src/busybox/rootfs/bin"
cat > "$src/pause.c" <<'C'
/* the sandbox's PID 1: exits on SIGINT/SIGTERM, reaps children */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void die(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction a = {.sa_handler = die};
  sigaction(SIGINT, &a, 0);
  sigaction(SIGTERM, &a, 0);
  struct sigaction b = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGCHLD, &b, 0);
  for (;;) pause();
}
C
gcc -static -O2 -o "$src/pause/rootfs/pause" "$src/pause.c"
strip "$src/pause/rootfs/pause"
(cd "$src" && apt-get download -q busybox-static >/dev/null && dpkg-deb -x busybox-static_*.deb bbx)
cp "$src/bbx/bin/busybox" "$src/busybox/rootfs/bin/busybox"
for a in sh ls cat env sleep grep echo mount stat test head wc; do
  ln -sf busybox "$src/busybox/rootfs/bin/$a"
done
image() { # NAME REF ENTRYPOINT
  local layout="$src/$1-layout" bundle="$src/$1-bundle"
  umoci init --layout "$layout"
  umoci new --image "$layout:latest"
  umoci unpack --rootless --image "$layout:latest" "$bundle" >/dev/null
  cp -a "$src/$1/rootfs/." "$bundle/rootfs/"
  umoci repack --image "$layout:latest" "$bundle"
  umoci config --image "$layout:latest" --config.entrypoint "$3" --architecture amd64 --os linux \
    --config.env PATH=/usr/local/bin:/bin
  skopeo copy --quiet "oci:$layout:latest" "docker-archive:$work/images/$1.tar:$2"
}
image pause "$pause_ref" /pause
image busybox "$busybox_ref" /bin/sh
image kube-scheduler "$scheduler_ref" /usr/local/bin/kube-scheduler
printf 'pause=%s\nbusybox=%s\nkube-scheduler=%s\n' "$pause_ref" "$busybox_ref" "$scheduler_ref" \
  > "$work/images/refs.env"
rm -rf "$src"

"$work/bin/kubelet" --version >&2
"$work/bin/containerd" --version >&2
rm -rf "$dest"
mkdir -p "$dest"
mv "$work/bin" "$work/images" "$dest/"
{ go version; echo "built in $((SECONDS - start))s on $(date -u +%FT%TZ)"; } > "$dest/complete"
echo "node/build.sh: node binaries built in $((SECONDS - start))s into $dest" >&2
echo "$dest"
