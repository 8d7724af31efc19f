# Evaluates services.nixcage with lib.evalModules and nothing else: real
# nixpkgs lib, the real module files, and stand-ins for the few NixOS options
# and pkgs attributes the glue touches. Used by nixeval_test.go.
#
#   nix-instantiate --eval --strict --json --expr \
#     'import ./checks/nixeval/eval.nix { lib = import $NIXPKGS_LIB/lib; module = ./examples/nixos/reference.nix; }'
{ lib, module }:
let
  inherit (import ./stubs.nix { inherit lib; }) pkgs nixosStubs;

  eval = lib.evalModules {
    modules = [ ../../nixos-modules nixosStubs module ];
  };
  c = eval.config;
  cfg = c.services.nixcage;
  names = map (p: p.name);
in
{
  inherit (cfg) enable model;
  failed = map (x: { inherit (x) id message; }) (lib.filter (x: !x.assertion) cfg.checks);
  checkIds = lib.unique (map (x: x.id) cfg.checks);
  nixosAssertions = lib.length c.assertions;
  configFile = if cfg.configFile == null then null else toString cfg.configFile;
  glue = lib.optionalAttrs cfg.enable {
    script = cfg.rendered.script;
    systemdPackages = names c.systemd.packages;
    tmpfilesPackages = names c.systemd.tmpfiles.packages;
    dbusPackages = names c.services.dbus.packages;
    etc = lib.mapAttrs (_: e: e.source) c.environment.etc;
    targets = c.systemd.targets;
  };
}
