#!/usr/bin/env bash
# Build the CPU image (deploy/docker/Dockerfile) and a Redis image for the compose stack without any
# container registry: the base image is a minimal Debian made with debootstrap from Debian's
# packages and imported into Docker; the Python packages come from a local wheel directory (torch's
# CPU build) and PyPI, at the versions in requirements.lock. Run from anywhere, as root (debootstrap
# and the Docker daemon need it):
#
#   deploy/docker/build-offline.sh                      # strata:cpu and strata-redis:bookworm
#   deploy/docker/build-offline.sh --wheels ~/wheels    # where torch's CPU wheel lies
#
# The base image (strata-base:bookworm) and the debootstrapped root file system it was imported from
# are kept, so a second run only builds the images on top (--rebuild-base makes them again).
# Builds use the host's network (`docker build --network host`): a daemon started with
# --iptables=false gives containers on its default bridge no route out.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: deploy/docker/build-offline.sh [options]
  --tag TAG          the Strata image (default strata:cpu)
  --redis-tag TAG    the Redis image for deploy/compose (default strata-redis:SUITE; "" skips it)
  --base-tag TAG     the Debian base image (default strata-base:SUITE)
  --suite SUITE      the Debian release of the base (default bookworm, whose python3 is 3.11)
  --mirror URL       the Debian mirror debootstrap and apt use (default: debootstrap's own)
  --security-mirror URL
                     Debian's security archive apt takes updates from (default
                     http://security.debian.org/debian-security; "" leaves it out)
  --wheels DIR       a directory of wheels pip may take, which must hold requirements.lock's torch
                     (default: the find-links directory pip is configured with, if any)
  --cert FILE        the CA bundle pip trusts in the build, for a proxy that re-signs TLS
                     (default: the cert pip is configured with, if any)
  --cache-dir DIR    where the root file system is kept (default $XDG_CACHE_HOME/strata-build)
  --rebuild-base     debootstrap and import the base again
Exit status: 0 built, 3 this machine lacks what the build needs (said why), 1 the build failed.
EOF
}

suite=bookworm
tag=strata:cpu
redis_tag=
redis_tag_set=0
base_tag=
mirror=
security_mirror=http://security.debian.org/debian-security
wheels=
cert=
cache_dir=${XDG_CACHE_HOME:-$HOME/.cache}/strata-build
rebuild_base=0
while [ $# -gt 0 ]; do
    case $1 in
        --tag) tag=$2; shift 2 ;;
        --redis-tag) redis_tag=$2; redis_tag_set=1; shift 2 ;;
        --base-tag) base_tag=$2; shift 2 ;;
        --suite) suite=$2; shift 2 ;;
        --mirror) mirror=$2; shift 2 ;;
        --security-mirror) security_mirror=$2; shift 2 ;;
        --wheels) wheels=$2; shift 2 ;;
        --cert) cert=$2; shift 2 ;;
        --cache-dir) cache_dir=$2; shift 2 ;;
        --rebuild-base) rebuild_base=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
done
base_tag=${base_tag:-strata-base:$suite}
[ "$redis_tag_set" = 1 ] || redis_tag=strata-redis:$suite

repo=$(cd "$(dirname "$0")/../.." && pwd)
log() { printf '[build-offline %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { printf 'build-offline: %s\n' "$*" >&2; exit 1; }
missing() { printf 'build-offline: %s\n' "$*" >&2; exit 3; }

docker info >/dev/null 2>&1 || missing "no Docker daemon answers (docker info failed): start dockerd, e.g. dockerd --iptables=false &"

# ------------------------------------------------------------------ what the host's pip uses
pip_setting() {  # $1: a pip option's name; its value in pip's configuration (files or PIP_*)
    python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'$/\1/p" | head -n 1
}
torch_pin=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' "$repo/requirements.lock")
if [ -z "$wheels" ]; then
    # the first find-links entry that is a local directory
    for link in ${PIP_FIND_LINKS:-} $(pip_setting find-links); do
        link=${link#file://}
        if [ -d "$link" ]; then wheels=$link; break; fi
    done
fi
# a wheel file name spells the version's "+" as is: torch-2.13.0+cpu-cp311-...
if [ -z "$wheels" ] || ! compgen -G "$wheels/torch-$torch_pin-*.whl" >/dev/null; then
    missing "no wheel of torch==$torch_pin (requirements.lock) in ${wheels:-any wheel directory}: pass --wheels DIR \
with it (pip download --no-deps torch==$torch_pin -d DIR, from PyTorch's CPU wheel index); \
PyPI's torch is a CUDA build of several GB"
fi
cert=${cert:-${PIP_CERT:-$(pip_setting cert)}}
[ -z "$cert" ] || [ -f "$cert" ] || die "no CA bundle at $cert (--cert)"

# ------------------------------------------------------------------ the Debian base image
if [ "$rebuild_base" = 1 ] || ! docker image inspect "$base_tag" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || missing "debootstrap is missing (apt-get install debootstrap)"
    [ "$(id -u)" = 0 ] || missing "debootstrap needs root: run this script as root"
    rootfs=$cache_dir/rootfs-$suite
    if [ "$rebuild_base" = 1 ] || [ ! -e "$rootfs.done" ]; then
        log "debootstrap $suite into $rootfs"
        rm -rf "$rootfs" "$rootfs.done"
        mkdir -p "$cache_dir"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            "$suite" "$rootfs" ${mirror:+"$mirror"} >"$rootfs.log" 2>&1 \
            || { tail -n 30 "$rootfs.log" >&2; die "debootstrap failed (log: $rootfs.log)"; }
        # apt in the image also sees the release's updates and security fixes (the image's build
        # upgrades to them); image layers keep no apt lists or package files, and later installs
        # leave out documentation (copyright files stay)
        sed -n 's/^deb \([^ ]*\) \([^ ]*\) \(.*\)$/deb \1 \2-updates \3/p' "$rootfs/etc/apt/sources.list" \
            >"$rootfs/etc/apt/sources.list.d/updates.list"
        if [ -n "$security_mirror" ]; then
            echo "deb $security_mirror $suite-security main" >"$rootfs/etc/apt/sources.list.d/security.list"
        fi
        cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
APT::Install-Recommends "false";
EOF
        cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
        rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/log/*.log
        touch "$rootfs.done"
    else
        log "reusing the root file system in $rootfs"
    fi
    log "importing it as $base_tag"
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' - "$base_tag" >/dev/null
else
    log "reusing the base image $base_tag"
fi

# ------------------------------------------------------------------ the images
# the build context: what the Dockerfile copies, plus pip/ (only the install stage sees it)
stage=$(mktemp -d "${TMPDIR:-/tmp}/strata-build.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp "$repo/pyproject.toml" "$repo/README.md" "$repo/requirements.lock" "$repo/deploy/docker/Dockerfile" \
    "$stage/"
tar -C "$repo" --exclude=__pycache__ --exclude='*.pyc' -c strata | tar -C "$stage" -x
mkdir -p "$stage/pip/wheels"
cp -l "$wheels"/*.whl "$stage/pip/wheels/" 2>/dev/null || cp "$wheels"/*.whl "$stage/pip/wheels/"
[ -z "$cert" ] || cp "$cert" "$stage/pip/cert.pem"

log "building $tag on $base_tag"
start=$(date +%s)
docker build --network host --force-rm --build-arg BASE="$base_tag" -f "$stage/Dockerfile" -t "$tag" "$stage"
log "built $tag in $(( $(date +%s) - start )) s, $(docker image inspect -f '{{.Size}}' "$tag" \
    | awk '{printf "%.0f MB", $1 / 1e6}')"

if [ -n "$redis_tag" ]; then
    log "building $redis_tag on $base_tag"
    # no build context: it copies nothing
    docker build --network host --force-rm --build-arg BASE="$base_tag" -t "$redis_tag" - \
        <"$repo/deploy/docker/Dockerfile.redis" >/dev/null
    log "built $redis_tag"
fi
