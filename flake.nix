{
  description = "nixcage: cages for untrusted AI agents, declared in Nix";

  # A NixOS release whose default Go satisfies go.mod's `go 1.25.0`
  # (nixos-25.05 ships Go 1.24). flake.lock pins one revision of it.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";

  outputs =
    { self, nixpkgs }:
    let
      inherit (nixpkgs) lib;
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});

      nixFiles = dir: lib.filterAttrs (n: t: t == "regular" && lib.hasSuffix ".nix" n) (builtins.readDir dir);
      byName = prefix: dir: f:
        lib.mapAttrs' (file: _: lib.nameValuePair (prefix + lib.removeSuffix ".nix" file) (f (dir + "/${file}"))) (nixFiles dir);

      # checks/vm/NAME.nix -> checks.<system>.vm-NAME, one NixOS VM test each.
      vmTests = pkgs: byName "vm-" ./checks/vm (file: pkgs.testers.runNixOSTest (import file { inherit self; }));

      # examples/nixos/NAME.nix -> checks.<system>.example-NAME: the example
      # evaluated as part of a NixOS system, its assertions enforced, then
      # validated and rendered by cagectl in the build. Documented examples
      # are tests.
      exampleChecks = pkgs: byName "example-" ./examples/nixos (file:
        let
          sys = lib.nixosSystem {
            modules = [
              self.nixosModules.default
              file
              {
                nixpkgs.hostPlatform = pkgs.stdenv.hostPlatform.system;
                system.stateVersion = "25.11";
              }
            ];
          };
          cfg = sys.config.services.nixcage;
          failed = lib.filter (c: !c.assertion) cfg.checks;
        in
        if failed == [ ] then cfg.rendered
        else throw (lib.concatMapStringsSep "\n" (c: "- " + c.message) failed));
    in
    {
      overlays.default = final: _prev: {
        nixcage = final.callPackage ./nix/package.nix { };
      };

      packages = forAllSystems (pkgs: rec {
        nixcage = pkgs.callPackage ./nix/package.nix { };
        default = nixcage;
      });

      nixosModules.default =
        { lib, pkgs, ... }:
        {
          imports = [ ./nixos-modules ];
          services.nixcage.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.nixcage;
        };
      nixosModules.nixcage = self.nixosModules.default;

      checks = forAllSystems (pkgs:
        { package = self.packages.${pkgs.stdenv.hostPlatform.system}.nixcage; }
        // exampleChecks pkgs
        // vmTests pkgs);

      devShells = forAllSystems (pkgs: {
        default = pkgs.mkShell {
          inputsFrom = [ self.packages.${pkgs.stdenv.hostPlatform.system}.nixcage ];
          packages = [ pkgs.gopls pkgs.gotools pkgs.nix pkgs.iproute2 pkgs.nixfmt-rfc-style ];
          # checks/nixeval evaluates the module against this lib.
          NIXPKGS_LIB = "${nixpkgs}";
        };
      });

      formatter = forAllSystems (pkgs: pkgs.nixfmt-rfc-style);
    };
}
