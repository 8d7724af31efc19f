# nixcage: caged, cage-egress, cagectl and cage-relay, built from this repository.
#
# vendorHash is the NAR hash of `go mod vendor`'s output; it lives in
# vendor.json next to the sha256 of the go.sum it was computed from, so that
# evaluation warns as soon as go.sum changes without it. Both are written by
# checks/vendor-hash.sh --update, and CI fails when they are stale.
{ lib, buildGoModule, installShellFiles }:
let
  vendor = lib.importJSON ./vendor.json;
  goSum = builtins.hashFile "sha256" ../go.sum;
  nixOnly = [ "flake.nix" "flake.lock" "nix" "nixos-modules" "checks/vm" ".ci" ];
in
lib.warnIf (goSum != vendor.goSum)
  "nixcage: go.sum changed since vendorHash was computed; run checks/vendor-hash.sh --update"
  (buildGoModule rec {
    pname = "nixcage";
    version = "0.1.0";

    # Everything Go and its tests read (sources, embedded policies, testdata,
    # examples, docs), nothing Nix-only, so editing the module or the VM
    # tests does not rebuild it.
    # (cleanSourceWith rather than lib.fileset so that checks/nixeval can
    # evaluate it with the Nix 2.8 of Debian 12.)
    src = lib.cleanSourceWith {
      name = "nixcage-source";
      src = lib.cleanSource ../.;
      filter =
        path: _type:
        let
          rel = lib.removePrefix (toString ../. + "/") (toString path);
        in
        !(lib.elem rel nixOnly || lib.any (d: lib.hasPrefix (d + "/") rel) nixOnly);
    };

    inherit (vendor) vendorHash;

    # The one version variable (internal/version): cagectl --version,
    # caged --version and caged's Version property (cagectl status) show it.
    ldflags = [ "-s" "-w" "-X github.com/nixcage/nixcage/internal/version.Version=${version}" ];

    # netgo: Go's own name resolver in every binary, so cage-egress (which
    # resolves only through its configured resolver, never the libc one)
    # links no libc: 1.4 MiB less resident per cage's gateway
    # (docs/performance.md, issue 20). caged keeps NSS for user lookups
    # (os/user still uses cgo without the osusergo tag).
    tags = [ "netgo" ];

    nativeBuildInputs = [ installShellFiles ];

    # Completions and the man page are generated from cagectl's own command
    # table, so they list exactly the commands and flags this build has.
    postInstall = ''
      installShellCompletion --cmd cagectl \
        --bash <($out/bin/cagectl completion bash) \
        --zsh <($out/bin/cagectl completion zsh) \
        --fish <($out/bin/cagectl completion fish)
      $out/bin/cagectl man > cagectl.1
      installManPage cagectl.1
    '';

    # Unit tests run in the sandbox; tests needing root, a booted systemd,
    # nix-instantiate or the network skip with a printed reason.
    preCheck = ''
      export HOME=$TMPDIR
    '';

    meta = {
      description = "Cages for untrusted AI agents: systemd sandboxes with an egress gateway and a signed tool store";
      homepage = "https://github.com/nixcage/nixcage";
      platforms = lib.platforms.linux;
      mainProgram = "cagectl";
    };
  })
