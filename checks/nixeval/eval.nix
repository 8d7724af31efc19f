# Evaluates services.nixcage with lib.evalModules and nothing else: real
# nixpkgs lib, the real module files, and stand-ins for the few NixOS options
# and pkgs attributes the glue touches. Used by nixeval_test.go.
#
#   nix-instantiate --eval --strict --json --expr \
#     'import ./checks/nixeval/eval.nix { lib = import $NIXPKGS_LIB/lib; module = ./examples/nixos/reference.nix; }'
{ lib, module }:
let
  fakeDrv = name: {
    type = "derivation";
    inherit name;
    outPath = "/nix/store/00000000000000000000000000000000-${name}";
  };

  pkgs = {
    runCommand = name: env: script: fakeDrv name // { inherit env script; };
    formats.json = { }: {
      generate = name: value: fakeDrv name // { json = builtins.toJSON value; };
    };
    iproute2 = fakeDrv "iproute2";
  };

  anything = lib.mkOption { type = lib.types.anything; default = null; };
  list = lib.mkOption { type = lib.types.listOf lib.types.anything; default = [ ]; };
  attrs = lib.mkOption { type = lib.types.attrsOf lib.types.anything; default = { }; };

  # The NixOS options the module reads or sets, with NixOS's types where
  # the merge behaviour matters (lists concatenate, attrsets merge).
  nixosStubs = {
    options = {
      assertions = list;
      virtualisation.podman.enable = lib.mkOption { type = lib.types.bool; default = false; };
      virtualisation.podman.package = lib.mkOption { type = lib.types.package; default = fakeDrv "podman"; };
      systemd.package = lib.mkOption { type = lib.types.package; default = fakeDrv "systemd"; };
      systemd.packages = list;
      systemd.tmpfiles.packages = list;
      systemd.targets = lib.mkOption { type = lib.types.attrsOf (lib.types.attrsOf lib.types.anything); default = { }; };
      services.dbus.packages = list;
      environment.systemPackages = list;
      environment.etc = lib.mkOption { type = lib.types.attrsOf (lib.types.attrsOf lib.types.anything); default = { }; };
    };
    config = {
      _module.args.pkgs = pkgs;
      services.nixcage.package = lib.mkDefault (fakeDrv "nixcage");
    };
  };

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
