# Learn mode and an approval queue with every default: `approval = { }`
# must stay a block in the model (an empty attribute set would be cleaned
# away), and the model validates in Go.
{
  services.nixcage = {
    enable = true;
    agents.a = {
      command = [ "/bin/true" ];
      learn = true;
      learnFor = "10m";
      approval = { };
    };
  };
}
