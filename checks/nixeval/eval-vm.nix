# Evaluates the nodes of one VM test (checks/vm/NAME.nix) far enough to get
# services.nixcage's model and assertions, so the declarations the VM tests
# boot are validated here even though the VMs cannot run here.
{ lib, file }:
let
  stubs = import ./stubs.nix { inherit lib; };
  self.nixosModules.default = ../../nixos-modules;
  test = import file { inherit self; };
  nodes = lib.mapAttrs (_: _: { networking.primaryIPAddress = "192.168.1.2"; }) test.nodes;
  node = m:
    let
      cfg = (lib.evalModules {
        modules = [ stubs.nixosStubs stubs.vmStubs { _module.args.nodes = nodes; } m ];
      }).config.services.nixcage or { enable = false; };
    in
    if cfg.enable or false then {
      inherit (cfg) model;
      failed = map (x: { inherit (x) id message; }) (lib.filter (x: !x.assertion) cfg.checks);
    } else null;
in
{
  inherit (test) name;
  script = test.testScript;
  nodes = lib.mapAttrs (_: node) test.nodes;
}
