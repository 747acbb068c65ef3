from .supervisor import main

main()
