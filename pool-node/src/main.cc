// kvpool-node: see pool-node/README.md.
#include "kvpool/pool_node/node_server.h"

int main(int argc, char** argv) { return kvpool::pool_node::NodeMain(argc, argv); }
