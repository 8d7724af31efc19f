# Enabled with nothing declared: caged alone, no agents.
{ services.nixcage.enable = true; }
