# services.nixcage: declare agents in Nix, get cages on nixos-rebuild switch.
#
# Split as microvm.nix and disko do: options.nix (the interface, lib only),
# model.nix (options -> HCL-JSON, lib only), asserts.nix (checks computed from
# data, lib only), render.nix (the one renderer, cagectl, run at build time),
# and this file, which wires the rest into NixOS.
{ config, lib, pkgs, ... }:
let
  cfg = config.services.nixcage;
in
{
  imports = [
    ./options.nix
    ./model.nix
    ./asserts.nix
    ./render.nix
  ];

  options.services.nixcage.package = lib.mkOption {
    type = lib.types.package;
    default = pkgs.nixcage or (throw ''
      services.nixcage.package is not set and pkgs has no nixcage. Import the
      module as nixcage.nixosModules.default (it sets the package), or add
      nixcage.overlays.default to nixpkgs.overlays.
    '');
    defaultText = lib.literalExpression "pkgs.nixcage";
    description = "The nixcage package (caged, cage-egress, cagectl).";
  };

  config = lib.mkIf cfg.enable {
    assertions = map (c: { inherit (c) assertion message; }) cfg.checks;
  };
}
