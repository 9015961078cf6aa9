#!/usr/bin/env bash
# Build the gpuslice container image, the one image every component runs, without a container
# registry and reproducibly: the same source gives the same image digest.
#
#   root filesystem  Debian bookworm from `mmdebstrap --variant=essential` (merged /usr) with
#                    python3 python3-venv ca-certificates libstdc++6; no docs, man pages or locales
#   Python           a venv in /opt/gpuslice: the wheel built from this checkout (`pip wheel .`,
#                    the standard build path) and exactly the wheels deploy/image/requirements.txt
#                    names (--require-hashes; scripts/lock-image-deps.py writes it), .pyc compiled
#                    with hash-based invalidation (no timestamps), pip and setuptools removed
#   image            one layer written by `umoci` into an OCI layout, user 65532, entrypoint
#                    `gpuslice`, OCI labels; `skopeo` exports it as an oci-archive
#   reproducible     SOURCE_DATE_EPOCH is the time of the last commit that touched the image's
#                    inputs (src/, pyproject.toml, LICENSE, Containerfile, this script,
#                    deploy/image/), the revision label is that commit (+"-dirty" when they have
#                    uncommitted changes), every newer mtime is clamped to it, PYTHONHASHSEED=0.
#                    Commits that touch only docs, tests or deploy/ manifests give the same
#                    digest, so the digest pinned in deploy/ does not change the image it pins.
#                    The Debian packages are what the mirror serves (DEBIAN_MIRROR, e.g. a
#                    snapshot.debian.org URL, freezes them); their list goes to packages.txt.
#
# Builds are cached under $GPUSLICE_IMAGE_CACHE (default ~/.cache/gpuslice-image), keyed by a
# hash of the inputs: a second run with the same source reuses the first (--no-cache rebuilds).
#
# Usage: scripts/build-image.sh [--out DIR] [--pin] [--no-cache]
#   --out DIR   where the oci-archive and image.json go (default dist/image)
#   --pin       write the digest into deploy/image.env, the production overlay and the chart
# Needs root (mmdebstrap, chroot), mmdebstrap, umoci, skopeo, python3 with pip, git, and the
# Debian mirror and PyPI (for the dependency wheels and the build backend); no registry.
# Exit status: 0 built (or reused), 1 the build failed, 2 bad arguments or a missing tool.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

OUT="$ROOT/dist/image"
PIN=0
USE_CACHE=1
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$(realpath -m "$2")"; shift ;;
        --pin) PIN=1 ;;
        --no-cache) USE_CACHE=0 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

die() { echo "build-image.sh: $*" >&2; exit 2; }
fail() { echo "build-image.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root: mmdebstrap and chroot build the root filesystem"
for tool in mmdebstrap umoci skopeo git python3; do
    command -v "$tool" >/dev/null || die "$tool is not installed (apt-get install -y mmdebstrap umoci skopeo)"
done

started=$(date +%s)
# shellcheck source=../deploy/image.env
. deploy/image.env
: "${IMAGE_REPOSITORY:?deploy/image.env sets no IMAGE_REPOSITORY}" "${IMAGE_TAG:?deploy/image.env sets no IMAGE_TAG}"
VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' src/gpuslice/__init__.py)"
[ -n "$VERSION" ] || die "no __version__ in src/gpuslice/__init__.py"
[ "$VERSION" = "$IMAGE_TAG" ] || die "deploy/image.env IMAGE_TAG=$IMAGE_TAG is not the package version $VERSION"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=python3,python3-venv,ca-certificates,libstdc++6
SOURCE_URL="${IMAGE_SOURCE:?deploy/image.env sets no IMAGE_SOURCE}"

# ---- the inputs, their revision and their hash --------------------------------------------------
INPUTS=(src pyproject.toml LICENSE Containerfile scripts/build-image.sh deploy/image)
[ -e setup.py ] && INPUTS+=(setup.py)
FILES=()
while IFS= read -r -d '' f; do [ -f "$f" ] && FILES+=("$f"); done \
    < <(git ls-files -z --cached --others --exclude-standard -- "${INPUTS[@]}" | sort -z -u)
COMMIT="$(git log -1 --format=%H -- "${INPUTS[@]}")"
[ -n "$COMMIT" ] || die "no commit touches ${INPUTS[*]}"
SOURCE_DATE_EPOCH="$(git log -1 --format=%ct -- "${INPUTS[@]}")"
export SOURCE_DATE_EPOCH
REVISION="$COMMIT"
[ -z "$(git status --porcelain -- "${INPUTS[@]}")" ] || REVISION="$COMMIT-dirty"
CREATED="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
KEY="$( { printf '%s\n' "$REVISION" "$MIRROR" "$SUITE" "$PACKAGES" "$IMAGE_REPOSITORY" "$SOURCE_URL"
          for f in "${FILES[@]}"; do printf '%s %s\n' "$(sha256sum < "$f" | cut -c1-64)" "$f"; done
        } | sha256sum | cut -c1-24)"

CACHE="${GPUSLICE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice-image}"
BUILD="$CACHE/builds/$KEY"
mkdir -p "$CACHE/wheels" "$CACHE/debs" "$CACHE/builds" "$OUT"

step() { echo "== $*"; echo "== $*" >&3; }

build() {
    local work="$1" r
    r="$work/bundle/rootfs"
    step "source ($REVISION, SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH)"
    mkdir -p "$work/src" "$work/wheels"
    printf '%s\0' "${FILES[@]}" | tar --null -T - -cf - | tar -C "$work/src" -xf -
    printf '"""Written by scripts/build-image.sh."""\n\nREVISION = "%s"\n' "$REVISION" \
        > "$work/src/src/gpuslice/_build_info.py"
    # the wheel's long description: a pointer, not the README (whose edits would change the image)
    printf '# gpuslice %s\n\nGPU sharing for ML inference on Kubernetes, built from revision %s.\n' \
        "$VERSION" "$REVISION" > "$work/src/README.md"

    step "wheel (pip wheel .)"
    python3 -m pip wheel --quiet --no-deps --wheel-dir "$work/wheels" "$work/src"

    step "dependency wheels (deploy/image/requirements.txt, cached in $CACHE/wheels)"
    local plat=() m
    for m in $(seq 36 -1 17); do plat+=(--platform "manylinux_2_${m}_x86_64"); done
    env -u PIP_FIND_LINKS python3 -m pip download --quiet --no-deps --require-hashes \
        --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 "${plat[@]}" \
        --platform manylinux2014_x86_64 --dest "$CACHE/wheels" -r deploy/image/requirements.txt
    env -u PIP_FIND_LINKS python3 -m pip download --quiet --no-deps --require-hashes --no-index \
        --find-links "$CACHE/wheels" --only-binary=:all: --python-version 3.11 \
        --implementation cp --abi cp311 "${plat[@]}" --platform manylinux2014_x86_64 \
        --dest "$work/wheels" -r deploy/image/requirements.txt

    step "root filesystem (mmdebstrap $SUITE, $PACKAGES)"
    umoci init --layout "$work/oci"
    umoci new --image "$work/oci:base"
    umoci unpack --image "$work/oci:base" "$work/bundle" >/dev/null
    rmdir "$r"
    # only .deb files go through the cache: anything else apt keeps there (its lock file) would
    # carry an earlier build's mtime into this one
    rm -rf "$CACHE/debs/lock" "$CACHE/debs/partial"
    mmdebstrap --quiet --mode=root --variant=essential --include="$PACKAGES" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-include=/usr/share/locale/locale.alias' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --skip=download/empty \
        --setup-hook='mkdir -p "$1"/var/cache/apt/archives' \
        --setup-hook="find '$CACHE/debs' -maxdepth 1 -name '*.deb' -exec cp -p -t \"\$1/var/cache/apt/archives/\" {} +" \
        --customize-hook="find \"\$1/var/cache/apt/archives\" -maxdepth 1 -name '*.deb' -exec cp -p -t '$CACHE/debs/' {} +" \
        --customize-hook='rm -f "$1"/var/cache/apt/archives/*.deb' \
        "$SUITE" "$r" "$MIRROR"
    chroot "$r" dpkg-query -W -f '${Package} ${Version}\n' > "$work/packages.txt"

    step "venv /opt/gpuslice"
    local inchroot=(chroot "$r" /usr/bin/env -i PATH=/opt/gpuslice/bin:/usr/sbin:/usr/bin
                    HOME=/root LC_ALL=C.UTF-8 PYTHONHASHSEED=0 SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH")
    mkdir -p "$r/tmp/wheels"
    cp "$work"/wheels/*.whl deploy/image/requirements.txt "$r/tmp/wheels/"
    "${inchroot[@]}" python3 -m venv /opt/gpuslice
    local pip=(pip install --quiet --no-index --no-cache-dir --no-compile --find-links /tmp/wheels)
    "${inchroot[@]}" "${pip[@]}" --require-hashes -r /tmp/wheels/requirements.txt
    "${inchroot[@]}" "${pip[@]}" --no-deps "/tmp/wheels/gpuslice-$VERSION-py3-none-any.whl"
    "${inchroot[@]}" pip uninstall --quiet --yes pip setuptools
    rm -rf "$r/tmp/wheels"

    step "trim, user 65532, bytecode"
    local sp="$r/opt/gpuslice/lib/python3.11/site-packages"
    find "$r/opt/gpuslice" -name __pycache__ -prune -exec rm -rf {} +
    rm -rf "$sp"/numpy/*/tests "$sp"/numpy/tests "$sp"/numpy/_pyinstaller
    find "$sp" -name '*.pyi' -delete
    rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin "$r"/var/cache/ldconfig/aux-cache \
        "$r"/var/log/* "$r"/tmp/* "$r"/root/.cache
    echo 'nonroot:x:65532:65532:gpuslice:/tmp:/usr/sbin/nologin' >> "$r/etc/passwd"
    echo 'nonroot:x:65532:' >> "$r/etc/group"
    "${inchroot[@]}" python3 -m compileall -q --invalidation-mode unchecked-hash \
        /opt/gpuslice/lib/python3.11/site-packages
    find "$r" -newermt "@$SOURCE_DATE_EPOCH" -print0 | xargs -0r touch --no-dereference --date="@$SOURCE_DATE_EPOCH"

    step "OCI image (umoci)"
    umoci repack --image "$work/oci:$IMAGE_TAG" --history.created="$CREATED" \
        --history.created_by="scripts/build-image.sh" --history.comment="gpuslice $VERSION" \
        "$work/bundle"
    local labels=(
        "org.opencontainers.image.title=gpuslice"
        "org.opencontainers.image.description=GPU sharing for ML inference on Kubernetes"
        "org.opencontainers.image.source=$SOURCE_URL"
        "org.opencontainers.image.revision=$REVISION"
        "org.opencontainers.image.version=$VERSION"
        "org.opencontainers.image.licenses=Apache-2.0 AND MIT"
        "org.opencontainers.image.created=$CREATED")
    local cfg=(--no-history --image "$work/oci:$IMAGE_TAG" --created="$CREATED"
               --config.user=65532:65532 --config.workingdir=/tmp
               --config.entrypoint=/opt/gpuslice/bin/gpuslice --config.cmd=--help
               --config.env=PATH=/opt/gpuslice/bin:/usr/sbin:/usr/bin:/sbin:/bin
               --config.env=HOME=/tmp --config.env=MPLCONFIGDIR=/tmp/matplotlib
               --config.env=PYTHONDONTWRITEBYTECODE=1 --config.env=PYTHONUNBUFFERED=1
               --config.env=LANG=C.UTF-8)
    local l
    for l in "${labels[@]}"; do cfg+=(--config.label="$l" --manifest.annotation="$l"); done
    umoci config "${cfg[@]}"
    umoci rm --image "$work/oci:base"
    umoci gc --layout "$work/oci"

    local manifest layer
    manifest="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$work/oci/index.json")"
    layer="$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]+"/blobs/sha256/"+sys.argv[2].split(":")[1])); print(m["layers"][0]["digest"].split(":")[1], m["layers"][0]["size"])' "$work/oci" "$manifest")"
    set -- $layer
    local uncompressed
    uncompressed="$(gzip -dc "$work/oci/blobs/sha256/$1" | wc -c)"
    {
        echo "digest=$manifest"
        echo "uncompressed_bytes=$uncompressed"
        echo "compressed_bytes=$2"
        echo "revision=$REVISION"
        echo "source_date_epoch=$SOURCE_DATE_EPOCH"
    } > "$work/result.env"
    mkdir "$work/result"
    mv "$work/oci" "$work/packages.txt" "$work/result.env" "$work/result/"
}

if [ "$USE_CACHE" = 1 ] && [ -f "$BUILD/result.env" ]; then
    echo "== cached build $BUILD (same inputs)"
else
    work="$(mktemp -d /tmp/gpuslice-image.XXXXXX)"
    trap 'rm -rf "$work"' EXIT
    # in the background so that `set -e` holds inside build (an `||` would switch it off);
    # the steps go to the terminal (fd 3), everything else to the log
    build "$work" 3>&1 >"$work/build.log" 2>&1 &
    if ! wait $!; then
        tail -n 40 "$work/build.log" >&2
        fail "the build failed (last lines of its log above)"
    fi
    rm -rf "$BUILD"
    mv "$work/build.log" "$work/result/"
    mv "$work/result" "$BUILD"
    # the cache keeps the three newest builds (each about 90 MB)
    find "$CACHE/builds" -mindepth 1 -maxdepth 1 -type d -printf '%T@ %p\n' | sort -rn \
        | tail -n +4 | cut -d' ' -f2- | xargs -r rm -rf
fi

# shellcheck source=/dev/null
. "$BUILD/result.env"
REF="$IMAGE_REPOSITORY:$IMAGE_TAG"
ARCHIVE="$OUT/gpuslice-$VERSION.oci.tar"
rm -f "$ARCHIVE"
skopeo copy --quiet "oci:$BUILD/oci:$IMAGE_TAG" "oci-archive:$ARCHIVE:$REF"
cat > "$OUT/image.json" <<EOF
{"reference": "$REF", "digest": "$digest", "revision": "$revision",
 "uncompressed_bytes": $uncompressed_bytes, "compressed_bytes": $compressed_bytes,
 "layout": "$BUILD/oci", "tag": "$IMAGE_TAG", "archive": "$ARCHIVE",
 "packages": "$BUILD/packages.txt", "build_log": "$BUILD/build.log"}
EOF

if [ "$PIN" = 1 ]; then
    python3 - "$digest" <<'EOF'
import re, sys
from pathlib import Path
digest = sys.argv[1]
for path, pattern, repl in [
    ("deploy/image.env", r"^IMAGE_DIGEST=.*$", f"IMAGE_DIGEST={digest}"),
    ("deploy/overlays/production/kustomization.yaml", r"^(\s+digest: ).*$", rf"\g<1>{digest}"),
    ("deploy/helm/gpuslice/values.yaml", r"^(\s+digest: ).*$", rf"\g<1>{digest}")]:
    p = Path(path)
    text, n = re.subn(pattern, repl, p.read_text(), count=1, flags=re.M)
    if n != 1:
        sys.exit(f"build-image.sh --pin: no digest line in {path}")
    p.write_text(text)
    print(f"pinned {digest} in {path}")
EOF
fi

printf 'image      %s@%s\n' "$REF" "$digest"
printf 'revision   %s\n' "$revision"
awk -v u="$uncompressed_bytes" -v c="$compressed_bytes" 'BEGIN {
    printf "size       %.1f MB uncompressed (goal <= 300 MB), %.1f MB compressed\n", u / 1e6, c / 1e6 }'
printf 'layout     %s (tag %s)\n' "$BUILD/oci" "$IMAGE_TAG"
printf 'archive    %s (podman load -i / skopeo copy oci-archive:...)\n' "$ARCHIVE"
printf 'took       %ss\n' "$(( $(date +%s) - started ))"
if [ "$digest" != "$IMAGE_DIGEST" ] && [ "$PIN" = 0 ]; then
    echo "note       deploy/image.env pins $IMAGE_DIGEST; run with --pin to pin this build"
fi
