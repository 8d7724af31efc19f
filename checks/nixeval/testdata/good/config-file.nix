# The HCL path through the same module: configFile instead of options.
{ services.nixcage = { enable = true; configFile = ../../../../examples/reference.hcl; }; virtualisation.podman.enable = true; }
