#!/usr/bin/env bash
# Build a tool closure with Nix, sign it as a release and publish it to a
# channel directory that a static web server serves (docs/fleet.md,
# "Publishing from CI"). Run by CI on every change to the tools; the hosts'
# caged pick the new generation up at their next poll.
#
#   examples/ci/publish-channel.sh --build tools.nix --key /run/secrets/release.key \
#       --pub /etc/nixcage/release.pub --channel stable --to /srv/www/nixcage/stable
#
# Options:
#   --build FILE      Nix expression to build (nix-build --no-out-link FILE [-A ATTR])
#   --attr ATTR       attribute of --build to build
#   --path STOREPATH  publish an already built store path instead of --build
#   --key FILE        private release key (PEM; repeatable for k-of-n)
#   --pub FILE        public key the hosts trust (repeatable); the release is
#                     verified with them before anything is published
#   --threshold N     distinct keys that must have signed (default 1)
#   --channel NAME    the channel (store.channel on the hosts)
#   --to DIR          the channel directory (the web server's root for it)
#   --generation N    default: the channel's current generation + 1
#   --expires D       release expiry: days (30d), a duration or RFC 3339 (default 30d)
#   --cagectl PATH    default: cagectl from PATH
#   -- ARGS...        passed on to nix-build (e.g. -- --argstr version "$CI_COMMIT")
#
# Publishing to a bucket instead of a directory: publish to a local copy of
# the channel, then upload everything but channel.json, then channel.json
# (e.g. `aws s3 sync DIR s3://B/stable --exclude channel.json && aws s3 cp
# DIR/channel.json s3://B/stable/channel.json`): hosts must never see an
# index naming files that are not there yet.
set -euo pipefail

die() { echo "publish-channel: $*" >&2; exit 2; }

build= attr= path= channel= to= generation= expires=30d threshold=1 cagectl=cagectl
keys=() pubs=()
while [ $# -gt 0 ]; do
	case "$1" in
	--build) build=$2; shift 2 ;;
	--attr) attr=$2; shift 2 ;;
	--path) path=$2; shift 2 ;;
	--key) keys+=(--key "$2"); shift 2 ;;
	--pub) pubs+=(--key "$2"); shift 2 ;;
	--threshold) threshold=$2; shift 2 ;;
	--channel) channel=$2; shift 2 ;;
	--to) to=$2; shift 2 ;;
	--generation) generation=$2; shift 2 ;;
	--expires) expires=$2; shift 2 ;;
	--cagectl) cagectl=$2; shift 2 ;;
	--) shift; break ;;
	*) die "unknown argument $1 (see the header of $0)" ;;
	esac
done
[ -n "$channel" ] || die "--channel is required"
[ -n "$to" ] || die "--to is required"
[ ${#keys[@]} -gt 0 ] || die "--key is required (the private release key)"
[ ${#pubs[@]} -gt 0 ] || die "--pub is required (the public key the hosts trust)"
if [ -z "$path" ]; then
	[ -n "$build" ] || die "give --build FILE or --path STOREPATH"
	if [ -n "$attr" ]; then
		path=$(nix-build --no-out-link "$build" -A "$attr" "$@")
	else
		path=$(nix-build --no-out-link "$build" "$@")
	fi
fi
if [ -z "$generation" ]; then
	current=0
	if [ -f "$to/channel.json" ]; then
		current=$(sed -n 's/^ *"generation": *\([0-9][0-9]*\).*/\1/p' "$to/channel.json")
		[ -n "$current" ] || die "$to/channel.json names no generation; pass --generation"
	fi
	generation=$((current + 1))
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$cagectl" release create "$path" "${keys[@]}" --channel "$channel" --generation "$generation" \
	--expires "$expires" --out "$work/release"
"$cagectl" release publish "$work/release" --to "$to" "${pubs[@]}" --threshold "$threshold"
