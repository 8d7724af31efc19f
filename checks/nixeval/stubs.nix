# Stand-ins for the parts of pkgs and NixOS that services.nixcage (and the
# VM tests' machine configurations) touch, so they evaluate with
# lib.evalModules and a real nixpkgs lib alone.
{ lib }:
rec {
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
    # Used by the VM tests only.
    buildEnv = a: fakeDrv a.name;
    writeShellScriptBin = name: _: fakeDrv name;
    writeText = name: _: fakeDrv name;
  } // lib.genAttrs [ "iproute2" "busybox" "curl" "jq" "nix" "openssl" "python3" ] fakeDrv;

  list = lib.mkOption { type = lib.types.listOf lib.types.anything; default = [ ]; };
  attrsOfAttrs = lib.mkOption { type = lib.types.attrsOf (lib.types.attrsOf lib.types.anything); default = { }; };

  # The NixOS options the module reads or sets, with NixOS's merge
  # behaviour where it matters (lists concatenate, attrsets merge).
  nixosStubs = {
    options = {
      assertions = list;
      virtualisation.podman.enable = lib.mkOption { type = lib.types.bool; default = false; };
      virtualisation.podman.package = lib.mkOption { type = lib.types.package; default = fakeDrv "podman"; };
      systemd.package = lib.mkOption { type = lib.types.package; default = fakeDrv "systemd"; };
      systemd.packages = list;
      systemd.tmpfiles.packages = list;
      systemd.targets = attrsOfAttrs;
      systemd.services = attrsOfAttrs;
      users.users = attrsOfAttrs;
      users.groups = attrsOfAttrs;
      services.dbus.packages = list;
      environment.systemPackages = list;
      environment.etc = attrsOfAttrs;
    };
    config = {
      _module.args.pkgs = pkgs;
      services.nixcage.package = lib.mkDefault (fakeDrv "nixcage");
    };
  };

  # What the VM tests' nodes set besides that; everything else at the top
  # level (users, networking, nix, security, system) is freeform.
  vmStubs = {
    config._module.freeformType = lib.types.lazyAttrsOf lib.types.anything;
    options = {
      virtualisation.memorySize = lib.mkOption { type = lib.types.int; };
      virtualisation.diskSize = lib.mkOption { type = lib.types.int; };
      systemd.services = attrsOfAttrs;
      systemd.tmpfiles.rules = list;
    };
  };
}
