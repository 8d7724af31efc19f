# want: services.nixcage.configFile is set together with agents
{
  services.nixcage.configFile = ../../../../examples/reference.hcl;
  services.nixcage.agents.a = { backend = "service"; command = [ "/bin/true" ]; };
}
