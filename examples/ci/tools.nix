# The tools every cage sees at /nix/tools, as CI builds them for a channel
# (examples/ci/publish-channel.sh). A real one is a buildEnv of nixpkgs
# packages, e.g.
#   { pkgs ? import <nixpkgs> { } }: pkgs.buildEnv { name = "tools"; paths = [ pkgs.git pkgs.nodejs ]; }
# This one needs neither nixpkgs nor the network, so the tests can build it
# (its builder is the host's /bin/sh: build it with `sandbox = false`).
{ version ? "dev" }:
derivation {
  name = "nixcage-tools-${version}";
  system = builtins.currentSystem;
  builder = "/bin/sh";
  args = [ "-c" ''
    /bin/mkdir -p $out/bin
    printf '#!/bin/sh\necho tools ${version}\n' > $out/bin/hello
    /bin/chmod 555 $out/bin/hello
  '' ];
}
