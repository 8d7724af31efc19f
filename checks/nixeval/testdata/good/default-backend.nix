# backend may be left out: the option is null, the model omits it, and the
# Go schema's default ("service") applies, as in HCL.
{
  services.nixcage = {
    enable = true;
    agents.a.command = [ "/bin/true" ];
  };
}
